# Local services (included by the root Makefile, which defines VENV, BIN, SAGE_HOME and `install`).
#   make up         Prefect server (127.0.0.1:$(PREFECT_PORT)) + MLflow UI (127.0.0.1:$(MLFLOW_PORT)) + deployments served
#   make down       stop them
#   make demo       install, up, run hint-study/tiny-cpu (--watch; no-hint eval every 4 steps), print the report card
#                   and the URLs
#   make serve      serve the deployments in the foreground (against a running server)
#   make dashboard  Streamlit dashboard on 127.0.0.1:$(DASHBOARD_PORT)
#   make mlflow-ui  the MLflow UI in the foreground
PREFECT_PORT ?= 4200
MLFLOW_PORT ?= 5000
DASHBOARD_PORT ?= 8501
DEMO_DEPLOYMENT ?= hint-study/tiny-cpu
DEMO_ARGS ?= --param eval_every=4
export PREFECT_PORT MLFLOW_PORT DASHBOARD_PORT
SERVICES = BIN="$(abspath $(BIN))" bash $(CURDIR)/flows/services.sh

.PHONY: mlflow-ui services-status

up: install
	$(SERVICES) up

down:
	$(SERVICES) down

services-status:
	$(SERVICES) status

serve:
	$(SERVICES) serve

# the report card also when a variant failed (the study's table has the others), then the run's exit code
demo: install
	$(SERVICES) up
	rc=0; $(SERVICES) run $(DEMO_DEPLOYMENT) $(DEMO_ARGS) || rc=$$?; \
	$(SERVICES) report --experiment hint-study-$(notdir $(DEMO_DEPLOYMENT)); exit $$rc

dashboard:
	SAGE_HOME="$(SAGE_HOME)" $(BIN)/streamlit run dashboards/app.py --server.headless true \
	  --server.address 127.0.0.1 --server.port $(DASHBOARD_PORT) --browser.gatherUsageStats false \
	  --client.toolbarMode viewer --global.disableWidgetStateDuplicationWarning true

mlflow-ui:
	$(SERVICES) mlflow-ui
