"""HTTP plumbing under every route: request bodies, request context, middleware, request timeout, disconnects."""
