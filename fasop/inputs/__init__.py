"""What a plan is made from: the model, the cluster, the GPU catalogue and the layer-time profiles, each read
from a file (bundled under clusters/, profiles/ and models/ or the user's own) and checked, with one-line errors."""
