"""The stateless worker: pull a user's turns under its lane, run the handler, write back."""
