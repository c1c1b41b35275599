"""The course's figures: one style, one colour per rank, and the drawings.

* :mod:`~labsupport.viz.style`: the style and the rank colours every figure uses;
* :mod:`~labsupport.viz.ranks`, :mod:`~labsupport.viz.collectives`: ranks on nodes,
  collectives before and after, the ring all-reduce step by step;
* :mod:`~labsupport.viz.roofline`, :mod:`~labsupport.viz.dtypes`,
  :mod:`~labsupport.viz.walls`, :mod:`~labsupport.viz.one_device`,
  :mod:`~labsupport.viz.clusters`: the figures of chapters 1 to 5.

A drawing takes numbers (measured by a lab, or computed by :mod:`labsupport.estimate`)
and returns a matplotlib figure; it never starts a process. The code a user takes to a
cluster never imports this package.
"""
