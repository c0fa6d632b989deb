"""Tools: the command line, usage reports, explanations, offline encodings (not bundled).

Modules: cli, explain, offline, report.
Not in the single file; may use every part.
See DESIGN.md, "Which part uses which".
"""
