"""Admission control: who may run now."""
