"""A user's own package, outside hpctrain: models, datasets, a loss and a metric that the tests'
configurations name by import path (``userpkg.models:classifier``)."""
