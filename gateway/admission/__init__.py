"""Admission: who is calling and whether they may."""
