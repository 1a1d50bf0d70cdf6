"""Engine fleets: engine groups of registered kinds (embedded, server, sglang, external) started from
the recipe's ``engines`` section and always put behind one :class:`~miles_engine.engines.router.Router`."""
