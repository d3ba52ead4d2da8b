"""eagle-datagen: token-exact EAGLE-3 drafter training data from SGLang's native /generate."""

__version__ = "0.1.0"
