"""jaxserve: a JAX-native language-model serving engine."""
