"""State: what outlives a turn, as bytes (the store; a chat's memory between turns).

Modules: chatstate, store.
It imports the core (a chat's memory holds its decision and pins) and nothing after it.
See DESIGN.md, "Which part uses which".
"""
