"""Money: prices, usage and cost, savings, the prompt cache, spending limits, the ledger.

Modules: accounting, cache_hints, cache_stats, calibration, dollars, ledger, limits, live_prices,
openturns, price_data, price_sources, pricing, records, savings, spendbook, usage.
It imports the core (token counts, the chat view) and the state, nothing of the face.
See DESIGN.md, "Which part uses which".
"""
