"""One module per model family, each declaring its ``FAMILY`` (a ``registry.ModelFamily``).

Every module here is read by ``tideserve.model.registry`` on the first architecture lookup: adding a
family is adding a file (and, when no existing class fits, its model class). Declarations only: no torch,
no model code, so they can be read while a config is parsed.
"""
