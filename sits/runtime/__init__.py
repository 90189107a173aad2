"""The serverless runtime: instances (engines in their own processes), and later units, the gateway,
the router and the autoscaler. It knows engines only through their public API."""
