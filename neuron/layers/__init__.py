"""Tensor-parallel building blocks: column- and row-parallel linears, vocabulary-parallel
embedding and head, norms and rotary tables, and the weight reader they load from."""
