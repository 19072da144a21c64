"""One module per kernel mechanism.

Each module exposes what the child runs (`apply_*`) and, where a mechanism has a
parent side (cgroups, uid maps), what the supervisor runs. None of them knows
about output pumping or results.
"""
