"""Tools the test modules share (fake servers, tiny models, reference decoding); nothing here is collected."""
