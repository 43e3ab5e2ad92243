"""fasop: plans for training Transformers with Megatron-LM on clusters that mix GPU types.

    import fasop
    plans = fasop.search(fasop.load_model("gpt2-xl"), fasop.load_cluster("fasop-1xA100-7xA10"))

returns a pandas DataFrame of every plan that fits memory, best first.
"""

from fasop.errors import InputError
from fasop.inputs.cluster import Cluster, load_cluster
from fasop.inputs.model import Model, load_model
from fasop.search import PlanSpec, estimate, plan_spec, search, search_plans

__all__ = ["Cluster", "InputError", "Model", "PlanSpec", "estimate", "load_cluster", "load_model", "plan_spec", "search",
           "search_plans"]
__version__ = "0.1.0"
