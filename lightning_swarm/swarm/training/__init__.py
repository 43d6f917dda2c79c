"""Optimisation across peers: trainer-driven stage steps (``stepping``, ``early_steps``), several trainers stepping as
DDP's ranks (``trainer_sync``), hivemind's optimizers and averagers as the swarm uses them (``optimizers``,
``averaging``) and the trainer's optimizers as a template for the stages' (``optimizer_template``)."""
