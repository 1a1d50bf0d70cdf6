from toy_vf_bad import CounterTaskset

__all__ = ["CounterTaskset"]
