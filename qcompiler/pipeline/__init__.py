"""Passes and how they run: the pass base and contract, registry, manager, recipes, and the rewrites passes share."""
