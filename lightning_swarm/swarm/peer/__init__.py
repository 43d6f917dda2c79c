"""One peer's life (:class:`~lightning_swarm.swarm.peer.peer.SwarmPeer`): stage partitioning and materialisation of
a model larger than one peer (``partition``, ``materialize``, ``deferred_init``), where to serve (``rebalance``,
``migration``), stage state (``stage_state``, ``checkpoint``), the trainer's optimisation (``steps``) and its helper
processes (``helpers``)."""
