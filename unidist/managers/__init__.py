"""One module per backend; import a backend's module only when it is selected (see unidist.selector)."""
