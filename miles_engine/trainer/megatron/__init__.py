"""The megatron-core trainer backend (``trainer.backend: megatron``): tensor / pipeline / expert
parallel ranks behind the same trainer interface as the torch backend.

- :mod:`.cpu_compat`: megatron-core's CUDA-only assumptions handled for CPU (gloo) runs.
- :mod:`.gpt`: HF configs as ``GPTModel``s; :class:`~.gpt.HFCausalLM` answers the HF call.
- :mod:`.hf_mapping`: HF <-> Megatron weights (fused QKV / gated MLP, TP / PP / EP shards).
- :mod:`.expert_parallel`: the MoE token dispatch with uneven token counts over EP ranks.
- :mod:`.trainer`: one rank (a ``TorchTrainer`` running on the Megatron model).
- :mod:`.proxy`: the driver-side object over the rank processes.
- :mod:`.state`: checkpoints in the torch backend's HF-named format (``checkpoint_format: hf``).
- :mod:`.dist_checkpoint` (+ :mod:`.dist_writer`): megatron-core's distributed format, every rank
  writing its own shards (``checkpoint_format: dist``); :mod:`.convert`: either to an HF directory.

megatron-core is imported lazily, only by these modules (extra ``megatron``).
"""
