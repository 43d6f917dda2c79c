"""lightning-swarm: train large models on preemptible GPUs over slow links (SWARM) and on small CPU
clusters (D-SLIDE), with one argument to the Lightning ``Trainer``."""

__version__ = "0.1.0"
