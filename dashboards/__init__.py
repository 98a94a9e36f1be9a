"""SAGE Studio dashboard (Streamlit): `streamlit run dashboards/app.py`. Data access in `dashboards.data`."""
