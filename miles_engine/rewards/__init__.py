"""Rewards: the protocol a reward component follows, weighted reward stacks, Harbor reward files.

A recipe's ``reward:`` section (:class:`~miles_engine.rewards.config.RewardConfig`) names the
components; :func:`~miles_engine.rewards.stack.build_reward_stack` builds them through the hub and
the episode runner scores each finished episode with the stack instead of the task's own verifier
(which stays available as the built-in component ``task``).
"""
