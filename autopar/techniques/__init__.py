"""Parallel techniques as plug-ins: one file each, registered on ``autopar.technique``'s registry.

``autopar.technique`` is the registry API (:class:`~autopar.technique.Technique`,
:class:`~autopar.technique.Family`, :class:`~autopar.technique.Pin`, ``register``, lookup); read
its docstring to add a technique. It is vocabulary (a low layer), so annotate and the cost model
read the registry without importing any technique. ``catalog`` imports every technique file of
this folder so each registers itself; the search, the lowering and the report import it.
"""
