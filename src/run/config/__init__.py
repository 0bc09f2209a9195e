"""A run's config, from the command line to built objects.

Composed as the command line would, checked before anything is built, and instantiated with
errors that name the node at fault.
"""
