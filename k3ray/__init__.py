"""k3ray: elastic Ray orchestration for Kimi-K3-class sparse MoE training."""
__version__ = "0.1.0"
