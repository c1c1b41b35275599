"""Calculators, and every datasheet number with its source.

* :mod:`~labsupport.estimate.units`: decimal and binary prefixes, bytes and counts;
* :mod:`~labsupport.estimate.dtypes`: bytes per dtype, floating-point formats bit by bit;
* :mod:`~labsupport.estimate.datasheets`: devices, links and published training runs;
* :mod:`~labsupport.estimate.params`: parameter counts of the course's models;
* :mod:`~labsupport.estimate.roofline`: FLOPs and bytes of a kernel, the roofline model;
* :mod:`~labsupport.estimate.flops`: the compute wall (6·N·D);
* :mod:`~labsupport.estimate.memory`: the memory wall (model states, activations);
* :mod:`~labsupport.estimate.walls`: which of the three walls binds;
* :mod:`~labsupport.estimate.web`: the website's calculators, the planner's answers as JSON.

Nothing here starts a process or touches a GPU: a calculator gives the same answer on
every machine, which is why the labs print its numbers beside each measurement.
"""
