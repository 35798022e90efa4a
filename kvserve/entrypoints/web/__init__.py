"""The browser page kvserve serves at `/`: a chat playground and a live dashboard (static files in static/,
routes in routes.py)."""
