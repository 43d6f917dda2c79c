"""A trainer's side of the pipeline: :class:`~lightning_swarm.swarm.client.client.SwarmClient` (differentiable stage
calls), choosing a peer (``routing``, ``discovery``), calls as autograd nodes (``stage_autograd``), microbatches in
flight (``chunking``, ``pipelining``, ``deferred_grads``) and its commands to the stages (``commands``)."""
