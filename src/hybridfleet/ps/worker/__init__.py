"""The worker side of the parameter server: session, client, site aggregation and framework front-end."""
