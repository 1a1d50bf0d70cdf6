from toy_vf_bad import BoxTaskset

__all__ = ["BoxTaskset"]
