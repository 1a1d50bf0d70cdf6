"""On-policy distillation teachers: scorers of the student's exact token ids (they never generate).

- :mod:`.protocol` — the typed :class:`Teacher` protocol, requests and scores;
- :mod:`.candidates` — candidate sets for top-K distillation (the math lives there);
- :mod:`.compat` — refusing a teacher whose tokenizer maps ids differently;
- :mod:`.routing` — multi-teacher routing by a sample tag;
- :mod:`.inprocess` — the built-in ``local`` teacher (a transformers model in this process);
- :mod:`.scoring` — the post-episode step that attaches teacher log-probs to trajectories.
"""
