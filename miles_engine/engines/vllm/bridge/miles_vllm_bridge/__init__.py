"""What runs inside vLLM's processes for miles-engine (on ``PYTHONPATH`` of the vLLM server the run
launches; vLLM's environment never has miles_engine installed, so nothing here imports it):

- :mod:`.launch`: start vLLM's OpenAI server on a free loopback port and write the port to a file
  (how the run's supervisor finds every engine process it starts);
- :mod:`.transfer`: the ``miles`` weight-transfer backend (vLLM's ``WeightTransferEngine``): join the
  trainer's process group (gloo on CPU, NCCL on GPU; the same group the trainer's broadcast
  transport builds for its own engines) and load each broadcast bucket into the model;
- :mod:`.worker`: the worker extension (``--worker-extension-cls``): registers that backend in each
  worker process and answers read-backs (per-tensor checksums, tensors by name) for checking a push.
"""
