"""Parallel techniques as plug-ins: one file each, registered on ``base``'s registry.

``base`` is the registry API (:class:`~autopar.techniques.base.Technique`,
:class:`~autopar.techniques.base.Family`, :class:`~autopar.techniques.base.Pin`, ``register``,
lookup); read its docstring to add a technique. ``catalog`` imports every technique file of this
folder so each registers itself; the search and the lowering import it. This package's
``__init__`` imports nothing, so annotate and the cost model read the registry through ``base``
without importing any technique.
"""
