"""Collectives between ranks (NCCL, gloo, a single rank): what tensor-parallel layers are built on."""
