"""vLLM as a rollout engine: its OpenAI-compatible server in its own Python environment, spoken to
in token ids (:mod:`.client`), launched and supervised by the run (``kind: vllm``), weights pushed
through vLLM's RL API into a weight-transfer backend of ours that runs inside vLLM's workers
(:mod:`.bridge`, a standalone package: vLLM's environment never imports miles_engine)."""
