"""One module per backend, imported only when its backend is selected (its record in unidist/backends/ says
how)."""
