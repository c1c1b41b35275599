"""What recomputation means for the course's models, as plain constants (no torch).

The calculators that count these models' bytes (:mod:`labsupport.estimate.memory`) import
them from here, not from the torch modules that use them, so that the calculators run
where torch does not: the website runs them in the reader's browser (Pyodide).
"""

#: The recomputation policies of :class:`labsupport.models.GPT` (Korthikanti et al. 2022):
#: keep every activation, recompute the attention core, or keep only each layer's input.
RECOMPUTE = ("none", "selective", "full")

#: Activation elements a :class:`labsupport.models.mlp.ResidualBlock` keeps for backward,
#: in units of ``b·d``.
BLOCK_UNITS = 9
