"""One peer's life (:class:`~lightning_swarm.swarm.peer.peer.SwarmPeer`) and the parts it owns, which share one
:class:`~lightning_swarm.swarm.peer.state.PeerState`: stage partitioning and materialisation of a model larger than one
peer (``partition``, ``materialize``, ``deferred_init``), where to serve and its stage server (``hosting``, the policy
in ``rebalance``), stage state (``stage_state``, ``checkpoint``), the trainer's optimisation (``steps``) and its helper
processes (``helpers``)."""
