"""The commands around training: ``study`` (a matrix of runs, :mod:`.study`), ``probe`` (a verdict on one
recipe, :mod:`.probe`) and ``plan`` (the pipeline planning table, :mod:`.plan`)."""
