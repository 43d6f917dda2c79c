"""The swarm's shared directory: a peer's identity and DHT (``identity``, ``bootstrap``, ``process``), the records it
publishes and accepts (``records``, ``validation``), private swarms (``auth``) and presence (``presence``)."""
