"""The training step a strategy makes: the batch contract (``batch``), the step that runs micro-batches under the
strategy's precision, loss and offload (``train_step``), and ``prepare``, which applies every technique to a model in
one order with an undo for each.

It sits right above ``memopt.techniques`` and below ``memopt.profile``: the profile traces this very step on fake
tensors, and ``memopt.apply`` runs it on the GPU, so what is estimated is what is run."""
