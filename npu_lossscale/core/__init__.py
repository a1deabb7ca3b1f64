"""The step: the pipeline every public API builds, in the order it runs.

``plan`` (phase 0, plain Python), ``gradients`` (1, its scale read
``scales``), ``overflow`` (2),
``window`` (3), ``close`` and ``commit`` (4), assembled by ``step``; beside
them the boundary checks (``checks``, ``context``, and ``hooks`` for what the seams' hooks return), the run-time claims
(``claims``), the graph's record (``graph_state``) and graph walks
(``graph_walk``, ``graph_copy``, ``update_ops``) and what counts as a
collective (``collectives``).
"""
