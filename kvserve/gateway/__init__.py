"""One endpoint for many models and replicas: the models config, routing across replicas, admission."""
