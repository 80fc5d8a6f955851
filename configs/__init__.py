"""memopt's bundled YAML configs, installed as the package ``memopt._configs`` (see memopt/resources.py)."""
