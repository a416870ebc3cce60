"""Engine outputs -> response bodies: a request's children run together, completions/chat shapes, echo."""
