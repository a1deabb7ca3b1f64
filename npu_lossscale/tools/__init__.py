"""The library's command-line tools, each a product of its own.

* ``port/``: ``python -m npu_lossscale.port``, a TF1 script's per-optimizer
  loss scaling rewritten into one builder (docs/port.md);
* ``audit_cli.py``: ``python -m npu_lossscale.audit``, the audit's command
  line (docs/audit.md).

They use the library through its public API, and nothing of the library
imports them but their documented entry points: ``npu_lossscale.port``
(a face) and ``npu_lossscale/audit/__main__.py``.
"""
