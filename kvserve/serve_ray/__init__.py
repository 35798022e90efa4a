"""`kvserve serve --models-config FILE.yaml --backend ray`: each model as a Ray Serve deployment behind one
OpenAI-compatible ingress, replicas autoscaled on queue depth. Ray is imported only by the modules that
need it, and only when this backend is chosen (`pip install kvserve[ray]`)."""
