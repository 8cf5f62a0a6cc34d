"""Pure tensor math, one method per module, no graphs: GPTQ (``gptq``), SpQR (``spqr``),
SmoothQuant's scales and α search (``smoothquant``), int8 grids (``int8``), min-max grids
(``quant_grid``), the GPTQ bit stream (``packing``) and a fast finiteness check (``finite``).
Each function that implements a paper's algorithm has a straightforward reference twin beside
it; passes call these, backends never do."""
