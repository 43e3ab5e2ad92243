"""What a run costs and which machines to rent: run length and price, compositions of the cluster's node
types, the Pareto front of cost against throughput, budgets and deadlines."""
