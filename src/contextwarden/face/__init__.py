"""The face: the Open WebUI filter (hooks, valves and settings, status lines, embedder, summary).

Modules: adminview, bookkeeping, budget, embedder, filter, hookargs, offloop, settings, status,
summarize, trimpass, turnsources, usergroups, valves.
The only part that knows Open WebUI's shapes; it calls the core, state and money.
See DESIGN.md, "Which part uses which".
"""
